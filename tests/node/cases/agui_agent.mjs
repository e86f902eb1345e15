// AG-UI's own client (HttpAgent of @ag-ui/client, pinned in ../package.json) against /api/ag-ui,
// as an AG-UI app (CopilotKit's runtime among them) drives it. SCENARIO picks what it does; the
// answer is every run's record (events, outcome, interrupts, pending calls, result, RUN_ERRORs,
// verifier and schema failures), the '[ag-ui]' warnings and the messages the agent holds.
//
// Environment: AGENTSTREAM_BASE, AGENTSTREAM_KEY, SCENARIO (tool | approval | frontend-tool |
// second-run | stale-history), THREAD_ID, TEXT, AGENT (JSON, forwardedProps.agent), APPROVE
// ("true"/"false").
import { recordingAgent } from "../lib/agui.mjs";
import { env, main, service } from "../lib/io.mjs";

const { base, headers } = service();
const scenario = env("SCENARIO");
const threadId = env("THREAD_ID");
const text = env("TEXT", "what is 6*7?");
const agentSettings = JSON.parse(env("AGENT", "{}"));
const json = (value) => JSON.parse(JSON.stringify(value));

const LOCATION = {
  name: "get_location",
  description: "Where the user is, as the browser knows it.",
  parameters: {
    type: "object",
    properties: { precision: { type: "string", enum: ["city", "street"] } },
    required: ["precision"],
  },
};

let counter = 0;
const messageId = (prefix) => `${prefix}-${threadId}-${++counter}`;

/** An HttpAgent on the thread, recording; `run` runs it and adds the agent's messages after. */
function agentOn(initialMessages = []) {
  const recorder = recordingAgent({ url: `${base}/api/ag-ui`, headers, threadId, initialMessages });
  const warnings = recorder.warnings;
  return {
    agent: recorder.agent,
    warnings,
    restore: recorder.restore,
    async run(params = {}) {
      const record = await recorder.run(params);
      return { ...record, messages: json(recorder.agent.messages) };
    },
  };
}

async function scenarioRuns() {
  const forwardedProps = { agent: agentSettings };
  const client = agentOn();
  try {
    const runs = [];
    if (scenario === "tool") {
      client.agent.addMessage({ id: messageId("u"), role: "user", content: text });
      runs.push(await client.run({ forwardedProps }));
    } else if (scenario === "approval") {
      client.agent.addMessage({ id: messageId("u"), role: "user", content: text });
      runs.push(await client.run({ forwardedProps }));
      const approved = env("APPROVE") === "true";
      // What an app's approval dialog answers, for each interrupt the agent holds.
      const resume = client.agent.pendingInterrupts.map((interrupt) =>
        approved
          ? { interruptId: interrupt.id, status: "resolved", payload: { approved: true } }
          : { interruptId: interrupt.id, status: "cancelled" },
      );
      runs.push({ ...(await client.run({ resume })), pendingAfter: json(client.agent.pendingInterrupts) });
    } else if (scenario === "frontend-tool") {
      client.agent.addMessage({ id: messageId("u"), role: "user", content: text });
      const first = await client.run({ tools: [LOCATION], forwardedProps });
      runs.push(first);
      // The app runs its tool, adds the tool message, and runs the agent again.
      for (const toolCallId of first.pendingToolCallIds) {
        client.agent.addMessage({ id: messageId("tool"), role: "tool", toolCallId, content: "Paris, France" });
      }
      runs.push(await client.run({ tools: [LOCATION] }));
    } else if (scenario === "second-run" || scenario === "stale-history") {
      client.agent.addMessage({ id: messageId("u"), role: "user", content: text });
      runs.push(await client.run({ forwardedProps }));
      // CopilotKit's runtime: a new agent per request, given the history the browser holds (a
      // stale browser, e.g. another tab's, holds none of the thread: only its new question).
      const held = scenario === "second-run" ? client.agent.messages : [];
      const next = agentOn([...held, { id: messageId("u"), role: "user", content: "and now?" }]);
      try {
        runs.push(await next.run({}));
        return { runs, warnings: [...client.warnings, ...next.warnings], messages: json(next.agent.messages) };
      } finally {
        next.restore();
      }
    } else {
      throw new Error(`unknown SCENARIO ${scenario}`);
    }
    return { runs, warnings: client.warnings, messages: json(client.agent.messages) };
  } finally {
    client.restore();
  }
}

main(scenarioRuns);
