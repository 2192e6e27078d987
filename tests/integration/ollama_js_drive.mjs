// Drives the npm `ollama` client (ollama-js) against a daemon (tests/integration/test_ollama_client.py): each step's
// result as one JSON object on stdout. argv: the Ollama URL, the API key; $OLLAMA_JS: the folder holding node_modules.
import { createRequire } from "node:module";

const require = createRequire(`${process.env.OLLAMA_JS}/`);
const { Ollama } = require("ollama");
const [host, key] = process.argv.slice(2);
const client = new Ollama({ host, headers: { Authorization: `Bearer ${key}` } });
const weather = { type: "function", function: { name: "get_weather", description: "The weather in a city",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } };
const greedy = { temperature: 0, num_predict: 8 };
const out = {};

out.list = (await client.list()).models.map((m) => m.model);
out.show = (await client.show({ model: "qwen3" })).capabilities;
const whole = await client.chat({ model: "tiny", messages: [{ role: "user", content: "Tell me a story" }], options: greedy });
out.chat = { content: whole.message.content, eval_count: whole.eval_count, done_reason: whole.done_reason };
let streamed = "";
for await (const part of await client.chat({ model: "tiny", messages: [{ role: "user", content: "Tell me a story" }],
  options: greedy, stream: true })) streamed += part.message.content;
out.chat_streamed = streamed;
let generated = "";
for await (const part of await client.generate({ model: "tiny", prompt: "Once upon a time", options: greedy,
  stream: true })) generated += part.response;
out.generate_streamed = generated;
out.generate = (await client.generate({ model: "tiny", prompt: "Once upon a time", options: greedy })).response;
const called = await client.chat({ model: "qwen3", messages: [{ role: "user", content: "OLLAMA-WEATHER in Paris?" }],
  tools: [weather] });
out.tool_calls = called.message.tool_calls.map((c) => [c.function.name, c.function.arguments]);
const thought = await client.chat({ model: "qwen3", messages: [{ role: "user", content: "OLLAMA-THINK please" }],
  think: true });
out.think = [thought.message.thinking, thought.message.content];
const schema = { type: "object", properties: { answer: { enum: ["yes", "no"] } }, required: ["answer"],
  additionalProperties: false };
out.format = (await client.chat({ model: "tiny", messages: [{ role: "user", content: "Say" }], format: schema,
  options: { num_predict: 30 } })).message.content;
out.embed = (await client.embed({ model: "embedder", input: ["first text", "second text"] })).embeddings.length;
out.ps = (await client.ps()).models.map((m) => m.model);
await client.copy({ source: "tiny", destination: "js-copy" });
out.copied = (await client.list()).models.some((m) => m.model === "js-copy:latest");
await client.delete({ model: "js-copy" });
out.deleted = !(await client.list()).models.some((m) => m.model === "js-copy:latest");
try {
  await client.chat({ model: "gpt-99", messages: [{ role: "user", content: "x" }] });
  out.unknown = null;
} catch (err) {
  out.unknown = [err.name, err.status_code, err.error];
}
console.log(JSON.stringify(out));
