// Checks a run webhook's Standard Webhooks signature the way the README's Node snippet does (only
// node:crypto). Parameters: WEBHOOK_SECRET, WEBHOOK_BODY_B64 (the raw body, base64),
// WEBHOOK_HEADERS (JSON of the received headers). Answers {"valid": bool, "record": body or null}.
import crypto from "node:crypto";

import { env, main } from "../lib/io.mjs";

// --- the README's snippet ---------------------------------------------------------------------
function verifyWebhook(secret, headers, rawBody, toleranceSeconds = 300) {
  const key = secret.startsWith("whsec_")
    ? Buffer.from(secret.slice("whsec_".length), "base64")
    : Buffer.from(secret, "utf8");
  const id = headers["webhook-id"];
  const timestamp = headers["webhook-timestamp"];
  const signatures = headers["webhook-signature"] ?? "";
  if (!id || !timestamp) return false;
  if (Math.abs(Date.now() / 1000 - Number(timestamp)) > toleranceSeconds) return false;
  const expected = crypto
    .createHmac("sha256", key)
    .update(Buffer.concat([Buffer.from(`${id}.${timestamp}.`), rawBody]))
    .digest();
  return signatures.split(" ").some((versioned) => {
    const [version, signature] = versioned.split(",", 2);
    const given = Buffer.from(signature ?? "", "base64");
    return version === "v1" && given.length === expected.length && crypto.timingSafeEqual(given, expected);
  });
}
// ------------------------------------------------------------------------------------------------

main(async () => {
  const body = Buffer.from(env("WEBHOOK_BODY_B64"), "base64");
  const valid = verifyWebhook(env("WEBHOOK_SECRET"), JSON.parse(env("WEBHOOK_HEADERS")), body);
  return { valid, record: valid ? JSON.parse(body.toString("utf8")) : null };
});
