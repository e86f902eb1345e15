// Folds chunk streams with the AI SDK's own readUIMessageStream (package `ai`), for a comparison
// with the service's fold (app/api/faces/aisdk/fold.py). CHUNKS_FILE: a JSON object of named
// chunk lists; the answer: the same names, each the message the client ends with (on an error
// chunk, the message as it was before it, which is what a chat keeps) and the error's text.
import { readFileSync } from "node:fs";
import { fold } from "../lib/aisdk.mjs";
import { env, main } from "../lib/io.mjs";

function streamOf(chunks) {
  return new ReadableStream({
    start(controller) {
      for (const chunk of chunks) controller.enqueue(chunk);
      controller.close();
    },
  });
}

main(async () => {
  const cases = JSON.parse(readFileSync(env("CHUNKS_FILE"), "utf8"));
  const out = {};
  for (const [name, chunks] of Object.entries(cases)) {
    try {
      const { message } = await fold(streamOf(chunks));
      out[name] = { message: JSON.parse(JSON.stringify(message)), error: null };
    } catch (error) {
      out[name] = { message: JSON.parse(JSON.stringify(error.partialMessage ?? null)), error: error.message };
    }
  }
  return out;
});
