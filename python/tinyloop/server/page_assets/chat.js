// The chat page: a conversation with the server through /api/v0/chat/completions (the OpenAI chat API plus the loop
// knobs), streamed; each answer ends with the stats the final chunk carries. No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "tinyloop-api-key";
const state = { model: null, messages: [], busy: false, pending: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key").focus();
}

async function connect() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    $("model").textContent = "locked";
    askForKey(sessionStorage.getItem(KEY) ? "that key was refused" : "");
    return false;
  }
  const body = await r.json();
  state.model = body.data && body.data.length ? body.data[0].id : "default";
  $("model").textContent = state.model;
  $("key-form").hidden = true;
  return true;
}

function turn(role, text) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  const content = document.createElement("span");
  content.className = "content";
  content.textContent = text;
  div.appendChild(content);
  $("conversation").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function request() {
  const loops = Number($("loops").value);
  const body = {
    model: state.model,
    messages: state.messages,
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("speculative").checked) Object.assign(body, { mode: "speculative", draft_loops: 2, verify_loops: loops });
  else if ($("auto").checked) Object.assign(body, { loops: "auto", max_loops: loops });
  else body.loops = loops;
  return body;
}

function describe(stats) {
  const parts = [
    `${stats.completion_tokens} tokens`,
    `${stats.tokens_per_second.toFixed(1)} tok/s`,
    stats.mean_loops === undefined ? `loops ${stats.loops_used}` : `loops auto, mean ${stats.mean_loops ?? "-"} of ${stats.loops_used}`,
  ];
  if (stats.time_to_first_token !== null) parts.push(`first token ${(stats.time_to_first_token * 1000).toFixed(0)} ms`);
  if (stats.cached_tokens) parts.push(`${stats.cached_tokens} prompt tokens reused`);
  if (stats.total_draft_tokens_count !== undefined) {
    parts.push(`drafts accepted ${stats.accepted_draft_tokens_count}/${stats.total_draft_tokens_count}` +
      ` (mean ${stats.mean_accepted_length} per round)`);
  }
  return parts.join(" · ");
}

// Read the SSE stream: text deltas into `into`, and the final chunk's stats (or an error) into its stats line.
async function stream(response, into) {
  const content = into.querySelector(".content");
  const stats = document.createElement("span");
  stats.className = "stats";
  into.appendChild(stats);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        stats.textContent = `error: ${chunk.error.message}`;
        stats.classList.add("error");
        continue;
      }
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          text += choice.delta.content;
          content.textContent = text;
        }
      }
      if (chunk.stats) stats.textContent = describe(chunk.stats);
    }
  }
  return text;
}

async function send(text) {
  state.busy = true;
  $("send").disabled = true;
  state.messages.push({ role: "user", content: text });
  const asked = turn("user", text);
  const answer = turn("assistant", "");
  try {
    const r = await fetch("/api/v0/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request()),
    });
    if (r.status === 401) {
      state.messages.pop();
      answer.remove();
      asked.remove();
      state.pending = text;
      askForKey("the server refused the key");
      return;
    }
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      state.messages.pop();
      answer.classList.add("error");
      answer.querySelector(".content").textContent = (body.error && body.error.message) || `HTTP ${r.status}`;
      return;
    }
    const reply = await stream(r, answer);
    state.messages.push({ role: "assistant", content: reply });
  } catch (e) {
    state.messages.pop();
    answer.querySelector(".content").textContent = `could not reach the server: ${e}`;
    answer.classList.add("error");
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

function bind() {
  $("loops").addEventListener("input", () => { $("loops-value").textContent = $("loops").value; });
  // Speculative drafting verifies at a fixed depth: the two modes exclude each other.
  $("auto").addEventListener("change", () => { if ($("auto").checked) $("speculative").checked = false; });
  $("speculative").addEventListener("change", () => { if ($("speculative").checked) $("auto").checked = false; });
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
  });
  $("clear").addEventListener("click", () => { state.messages = []; $("conversation").replaceChildren(); });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value.trim();
    if (!text || state.busy) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    if (await connect() && state.pending !== null) {
      const text = state.pending;
      state.pending = null;
      send(text);
    }
  });
}

bind();
connect();
