"""The chat page `dormouse serve` answers at /: one HTML file, no dependencies. It keeps the conversation in the
page, posts it to /v1/chat/completions with `stream: true` and appends each server-sent delta to the reply. When the
server has an API key (--api-key) the page asks for it and sends it as a Bearer token; it is same-origin, so the
server's Origin check lets it through."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dormouse: {{MODEL}}</title>
<style>
  body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
  #log { display: flex; flex-direction: column; gap: .6rem; margin-bottom: 1rem; }
  .msg { padding: .5rem .75rem; border-radius: .5rem; white-space: pre-wrap; }
  .user { background: #e8eefc; align-self: flex-end; }
  .assistant { background: #f1f1f1; align-self: flex-start; min-width: 2rem; }
  .error { background: #fde8e8; }
  form { display: flex; gap: .5rem; }
  textarea { flex: 1; font: inherit; padding: .4rem; }
  small { color: #777; }
</style>
</head>
<body>
<h1>dormouse</h1>
<p><small>model <code>{{MODEL}}</code> &middot; temperature
  <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.8" style="width:4rem">
  &middot; max bytes <input id="max_tokens" type="number" min="1" max="4096" value="256" style="width:5rem"></small></p>
<div id="log"></div>
<form id="form">
  <textarea id="input" rows="2" placeholder="Say something; Enter sends, Shift+Enter for a new line"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
const log = document.getElementById("log"), input = document.getElementById("input");
const history = [];
const KEY_REQUIRED = {{KEY_REQUIRED}};  // dormouse serve --api-key: the page asks once, keeps it for this tab
let apiKey = sessionStorage.getItem("dormouse-api-key") || "";
function askKey(why) {
  apiKey = (window.prompt(why + " Enter the API key dormouse serve was started with (--api-key):") || "").trim();
  sessionStorage.setItem("dormouse-api-key", apiKey);
}
function post(body) {
  const headers = {"Content-Type": "application/json"};
  if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
  return fetch("/v1/chat/completions", {method: "POST", headers, body});
}
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  log.appendChild(div);
  return div;
}
input.addEventListener("keydown", e => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); document.getElementById("form").requestSubmit(); }
});
document.getElementById("form").addEventListener("submit", async e => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  history.push({role: "user", content: text});
  bubble("user", text);
  const reply = bubble("assistant", "");
  reply.id = "reply-" + history.length;
  document.getElementById("send").disabled = true;
  try {
    const body = JSON.stringify({messages: history, stream: true,
      temperature: Number(document.getElementById("temperature").value),
      max_tokens: Number(document.getElementById("max_tokens").value)});
    if (KEY_REQUIRED && !apiKey) askKey("This server needs an API key.");
    let res = await post(body);
    if (res.status === 401) {  // no key, or a wrong one: ask (again) and retry once
      askKey("The server refused the key.");
      res = await post(body);
    }
    if (!res.ok) {
      const err = await res.json();
      reply.className = "msg error";
      reply.textContent = err.error ? err.error.message : res.statusText;
      history.pop();
      return;
    }
    const reader = res.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") { reply.dataset.done = "1"; continue; }
        const delta = JSON.parse(data).choices[0]?.delta || {};
        if (delta.content) reply.textContent += delta.content;
      }
    }
    history.push({role: "assistant", content: reply.textContent});
  } finally {
    document.getElementById("send").disabled = false;
    reply.dataset.finished = "1";
  }
});
</script>
</body>
</html>
"""
