/**
 * Tool calls that wait for a person (RUNS.md A-02..A-07): the approval card a run's timeline shows
 * for each `approval {status: "requested"}` event, and the inbox of pending approvals across
 * conversations. A card shows the tool and its arguments as editable JSON; Approve sends them
 * (edited or not), Deny sends the reason typed beside it. The card settles when the run announces
 * the decision (`approved`, `denied`, `expired`), or at once from the route's answer.
 */

import { el } from "./run_view.js";

const SETTLED_TEXT = {
  approved: "Approved",
  denied: "Denied",
  expired: "Expired: nobody decided in time",
  closed: "Already decided",
};

function pretty(value) {
  try {
    return JSON.stringify(value ?? {}, null, 2);
  } catch {
    return String(value);
  }
}

/**
 * The card of one requested approval. `decide(body)` posts the decision and resolves to the
 * route's answer ({status}), or rejects with an ApiError (a 409 settles the card as closed).
 */
export function approvalCard(data, decide) {
  const args = el("textarea", {
    className: "approval-args",
    "data-testid": "approval-args",
    rows: Math.min(12, pretty(data.tool_args).split("\n").length + 1),
    spellcheck: "false",
    "aria-label": "Arguments (JSON)",
  });
  args.value = pretty(data.tool_args);
  const reason = el("input", {
    className: "approval-reason",
    "data-testid": "approval-reason",
    type: "text",
    maxlength: "2000",
    placeholder: "Reason (optional)",
    "aria-label": "Reason for denying",
  });
  const error = el("p", { className: "approval-error", "data-testid": "approval-error", role: "alert", hidden: true });
  const outcome = el("p", { className: "approval-outcome", "data-testid": "approval-outcome", hidden: true });
  const approve = el("button", { type: "button", className: "primary", "data-testid": "approve-button" }, "Approve");
  const deny = el("button", { type: "button", className: "secondary danger", "data-testid": "deny-button" }, "Deny");
  const expires = data.expires_at ? new Date(data.expires_at) : null;
  const root = el(
    "div",
    {
      className: "approval-card",
      "data-testid": "approval-card",
      "data-approval-id": data.approval_id ?? "",
      "data-state": "pending",
      role: "group",
      "aria-label": `Approval of ${data.tool_name ?? "a tool call"}`,
    },
    el(
      "div",
      { className: "approval-head" },
      el("strong", {}, "Approval needed: "),
      el("code", { "data-testid": "approval-tool" }, data.tool_name ?? "tool"),
      expires && !Number.isNaN(expires.getTime())
        ? el("span", { className: "approval-expiry" }, ` · expires ${expires.toLocaleString()}`)
        : null,
    ),
    el("label", { className: "approval-label" }, "Arguments (you can edit them)", args),
    el("div", { className: "approval-actions" }, approve, reason, deny),
    error,
    outcome,
  );

  const card = {
    root,
    settled: false,
    /** The decision is known: the controls go, the outcome stays. */
    settle(status, why, ranWith) {
      if (card.settled && status === "closed") return;
      card.settled = true;
      root.dataset.state = status;
      for (const control of [args, reason, approve, deny]) control.disabled = true;
      error.hidden = true;
      let text = SETTLED_TEXT[status] ?? status;
      if (status === "approved" && ranWith !== undefined) text += ` · runs with ${JSON.stringify(ranWith)}`;
      if (why) text += ` · ${why}`;
      outcome.textContent = text;
      outcome.hidden = false;
    },
  };

  async function send(body) {
    error.hidden = true;
    approve.disabled = deny.disabled = true;
    try {
      const answer = await decide(body);
      card.settle(answer?.status ?? (body.decision === "approve" ? "approved" : "denied"), body.reason, body.tool_args);
    } catch (err) {
      if (err?.status === 409) {
        card.settle("closed");
        return;
      }
      error.textContent = err?.message ?? String(err);
      error.hidden = false;
      approve.disabled = deny.disabled = false;
    }
  }

  approve.addEventListener("click", () => {
    let edited;
    try {
      edited = JSON.parse(args.value);
    } catch (err) {
      error.textContent = `The arguments are not valid JSON: ${err.message}`;
      error.hidden = false;
      return;
    }
    if (edited === null || typeof edited !== "object" || Array.isArray(edited)) {
      error.textContent = "The arguments must be a JSON object.";
      error.hidden = false;
      return;
    }
    const body = { decision: "approve" };
    if (JSON.stringify(edited) !== JSON.stringify(data.tool_args ?? {})) body.tool_args = edited;
    send(body);
  });
  deny.addEventListener("click", () => {
    const body = { decision: "deny" };
    if (reason.value.trim()) body.reason = reason.value.trim();
    send(body);
  });
  return card;
}

/** The inbox: every pending approval of the caller, oldest first, each a link to its conversation. */
export function renderInbox(list, items) {
  list.replaceChildren(
    ...items.map((item) =>
      el(
        "li",
        { "data-testid": "inbox-item", "data-approval-id": item.approval_id },
        el(
          "a",
          { href: `#/c/${encodeURIComponent(item.conversation_id)}` },
          el("code", {}, item.tool_name),
          " ",
          el("span", { className: "inbox-args" }, JSON.stringify(item.tool_args).slice(0, 60)),
        ),
      ),
    ),
  );
}
