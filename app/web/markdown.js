/**
 * A small Markdown renderer for model output, written to be safe by construction: every piece of
 * source text is HTML-escaped before any markup is added, and links only keep http(s), mailto and
 * same-site URLs. Supports paragraphs, headings, fenced code, inline code, emphasis, strikethrough,
 * links, autolinks, block quotes, nested lists (with task boxes), pipe tables and rules.
 */

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Escaped text cannot contain a quote, so these prefixes are all a URL needs to be harmless.
const SAFE_URL = /^(https?:\/\/|mailto:|\/(?!\/)|#)/i;

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEPARATOR = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

/** Render Markdown source to an HTML string in which all source text is escaped. */
export function renderMarkdown(source) {
  // NUL is the placeholder delimiter of renderInline; no real text needs it.
  const text = String(source ?? "").replace(/\r\n?/g, "\n").replace(/\u0000/g, "\uFFFD");
  return renderBlocks(text.split("\n"));
}

function renderBlocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const fence = FENCE.exec(line);
    if (fence) {
      i = renderFence(lines, i, fence, out);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const level = heading[1].length;
      out.push(`<h${level}>${renderInline(heading[2] ?? "")}</h${level}>`);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.push("<hr>");
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && QUOTE.test(lines[i])) {
        inner.push(lines[i].replace(QUOTE, ""));
        i += 1;
      }
      out.push(`<blockquote>${renderBlocks(inner)}</blockquote>`);
      continue;
    }
    if (LIST_ITEM.test(line)) {
      const [html, next] = renderList(lines, i);
      out.push(html);
      i = next;
      continue;
    }
    if (isTableStart(lines, i)) {
      i = renderTable(lines, i, out);
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !(para.length && startsBlock(lines, i))) {
      para.push(lines[i].trim());
      i += 1;
    }
    out.push(`<p>${renderInline(para.join("\n"))}</p>`);
  }
  return out.join("\n");
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    RULE.test(line) ||
    QUOTE.test(line) ||
    LIST_ITEM.test(line) ||
    isTableStart(lines, i)
  );
}

function renderFence(lines, start, match, out) {
  const marker = match[1];
  const lang = match[2];
  const body = [];
  let i = start + 1;
  // An unclosed fence (common while an answer is still streaming) runs to the end of the text.
  while (i < lines.length) {
    const close = lines[i].trim();
    if (close.startsWith(marker[0].repeat(marker.length)) && /^([`~])\1*$/.test(close)) {
      i += 1;
      break;
    }
    body.push(lines[i]);
    i += 1;
  }
  const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
  out.push(`<pre><code${cls}>${escapeHtml(body.join("\n"))}</code></pre>`);
  return i;
}

function indentOf(text) {
  return text.replace(/\t/g, "    ").match(/^ */)[0].length;
}

function renderList(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const baseIndent = indentOf(first[1]);
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    if (!sameList(lines[i], baseIndent, ordered)) break;
    const m = LIST_ITEM.exec(lines[i]);
    const textLines = [m[3]];
    const nested = [];
    i += 1;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        // A blank line only continues the list if more of it follows.
        const next = lines[i + 1];
        if (next !== undefined && (indentOf(next) > baseIndent || sameList(next, baseIndent, ordered))) {
          i += 1;
          continue;
        }
        break;
      }
      const sub = LIST_ITEM.exec(line);
      if (sub && indentOf(sub[1]) > baseIndent) {
        const [html, next] = renderList(lines, i);
        nested.push(html);
        i = next;
        continue;
      }
      if (sub || (indentOf(line) <= baseIndent && startsBlock(lines, i))) break;
      textLines.push(line.trim());
      i += 1;
    }
    items.push(renderListItem(textLines.join("\n"), nested.join("")));
  }
  const startNumber = ordered ? parseInt(first[2], 10) : 1;
  const startAttr = ordered && startNumber !== 1 ? ` start="${startNumber}"` : "";
  const tag = ordered ? "ol" : "ul";
  return [`<${tag}${startAttr}>${items.join("")}</${tag}>`, i];
}

function sameList(line, baseIndent, ordered) {
  const m = LIST_ITEM.exec(line);
  return Boolean(m) && indentOf(m[1]) === baseIndent && /\d/.test(m[2]) === ordered;
}

function renderListItem(text, nestedHtml) {
  const task = /^\[([ xX])\]\s+/.exec(text);
  if (task) {
    const checked = task[1] === " " ? "" : " checked";
    const body = renderInline(text.slice(task[0].length));
    return `<li class="task"><input type="checkbox" disabled${checked}> ${body}${nestedHtml}</li>`;
  }
  return `<li>${renderInline(text)}${nestedHtml}</li>`;
}

function isTableStart(lines, i) {
  const next = lines[i + 1];
  return lines[i].includes("|") && next !== undefined && next.includes("-") && TABLE_SEPARATOR.test(next);
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function renderTable(lines, start, out) {
  const header = splitRow(lines[start]);
  const aligns = splitRow(lines[start + 1]).map((cell) => {
    const left = cell.startsWith(":");
    const right = cell.endsWith(":");
    if (left && right) return "center";
    if (right) return "right";
    if (left) return "left";
    return "";
  });
  const cell = (tag, content, col) => {
    const align = aligns[col] ? ` style="text-align:${aligns[col]}"` : "";
    return `<${tag}${align}>${renderInline(content)}</${tag}>`;
  };
  const rows = [];
  let i = start + 2;
  while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
    const cells = splitRow(lines[i]);
    rows.push(`<tr>${header.map((_, col) => cell("td", cells[col] ?? "", col)).join("")}</tr>`);
    i += 1;
  }
  const head = `<tr>${header.map((h, col) => cell("th", h, col)).join("")}</tr>`;
  out.push(`<div class="table-wrap"><table><thead>${head}</thead><tbody>${rows.join("")}</tbody></table></div>`);
  return i;
}

/**
 * Inline markup of one block's text. Code spans and links become placeholders first, so nothing
 * inside them is formatted while emphasis can still span them.
 */
export function renderInline(text) {
  const parts = [];
  const withCode = text.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) =>
    stash(parts, `<code>${escapeHtml(code.trim() || code)}</code>`),
  );
  let html = formatText(withCode, parts);
  // Placeholders may nest (code inside a link label), so restore until none is left.
  while (/\u0000\d+\u0000/.test(html)) {
    html = html.replace(/\u0000(\d+)\u0000/g, (_, n) => parts[Number(n)]);
  }
  return html;
}

function stash(parts, html) {
  parts.push(html);
  return `\u0000${parts.length - 1}\u0000`;
}

function formatText(raw, parts) {
  let s = escapeHtml(raw);
  s = s.replace(/\[([^\]\n]+)\]\(\s*((?:[^\s()]|\([^\s()]*\))+)(?:\s+&quot;[^\n]*?&quot;)?\s*\)/g, (whole, label, url) => {
    if (!SAFE_URL.test(url)) return stash(parts, emphasis(label));
    return stash(parts, `<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`);
  });
  // Escaped text: "&amp;" may be part of a URL, the other entities end it.
  s = s.replace(/https?:\/\/(?:[^\s&\u0000]|&amp;)+/g, (url) => {
    const trimmed = url.replace(/[.,;:!?)\]*_]+$/, "");
    const rest = url.slice(trimmed.length);
    return stash(parts, `<a href="${trimmed}" target="_blank" rel="noopener noreferrer">${trimmed}</a>`) + rest;
  });
  return emphasis(s).replace(/\n/g, "<br>");
}

function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*([^\s*](?:[^*\n]*?[^\s*])?)\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_([^\s_](?:[^_\n]*?[^\s_])?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}
