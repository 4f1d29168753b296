// inferplane console playground: streams a chat completion (SSE) from the console's relay,
// which adds the signed-in key server-side. Reasoning, content and tool calls render apart.
"use strict";

(function () {
  const form = document.getElementById("playground");
  if (!form) return;
  const out = {
    status: document.getElementById("status"),
    reasoning: document.getElementById("reasoning"),
    content: document.getElementById("content"),
    tools: document.getElementById("tool-calls"),
  };

  function parseJson(text, what, fallback) {
    if (!text.trim()) return fallback;
    try {
      return JSON.parse(text);
    } catch (err) {
      throw new Error(what + " is not valid JSON: " + err.message);
    }
  }

  function buildRequest() {
    const messages = [];
    const system = form.elements.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: form.elements.message.value });
    const body = { model: form.elements.model.value.trim(), messages: messages, stream: true };
    const tools = parseJson(form.elements.tools.value, "Tools", null);
    if (tools !== null) {
      if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array.");
      if (tools.length) body.tools = tools;
    }
    const kwargs = parseJson(form.elements.template_kwargs.value, "Chat template arguments", null);
    if (kwargs !== null) body.chat_template_kwargs = kwargs;
    const temperature = form.elements.temperature.value.trim();
    if (temperature !== "") body.temperature = Number(temperature);
    return body;
  }

  // One card per tool call, keyed by the OpenAI `index`; arguments arrive in pieces.
  const calls = new Map();
  function card(index) {
    let call = calls.get(index);
    if (call) return call;
    const article = document.createElement("article");
    article.className = "tool-call";
    article.setAttribute("aria-label", "Tool call " + (index + 1));
    const title = document.createElement("h4");
    const id = document.createElement("p");
    const args = document.createElement("pre");
    article.append(title, id, args);
    out.tools.append(article);
    call = { article: article, title: title, idEl: id, argsEl: args, name: "", id: "", args: "" };
    calls.set(index, call);
    return call;
  }

  function applyToolDelta(delta) {
    const call = card(delta.index || 0);
    if (delta.id) call.id = delta.id;
    if (delta.function) {
      if (delta.function.name) call.name += delta.function.name;
      if (delta.function.arguments) call.args += delta.function.arguments;
    }
    call.title.textContent = call.name || "(unnamed)";
    call.idEl.textContent = call.id ? "id " + call.id : "";
    call.argsEl.textContent = call.args;
  }

  function finishToolCards() {
    for (const call of calls.values()) {
      try {
        call.argsEl.textContent = JSON.stringify(JSON.parse(call.args || "{}"), null, 2);
        call.article.dataset.valid = "true";
      } catch (err) {
        call.article.dataset.valid = "false";
      }
      call.article.dataset.name = call.name;
    }
  }

  function handleEvent(data) {
    if (data === "[DONE]") return true;
    const event = JSON.parse(data);
    if (event.error) throw new Error(event.error.message || "stream error");
    for (const choice of event.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) out.reasoning.textContent += delta.reasoning_content;
      if (delta.content) out.content.textContent += delta.content;
      for (const tc of delta.tool_calls || []) applyToolDelta(tc);
      if (choice.finish_reason) out.status.textContent = "finish_reason: " + choice.finish_reason;
    }
    return false;
  }

  async function send(event) {
    event.preventDefault();
    out.reasoning.textContent = "";
    out.content.textContent = "";
    out.tools.textContent = "";
    calls.clear();
    let body;
    try {
      body = buildRequest();
    } catch (err) {
      out.status.textContent = err.message;
      return;
    }
    form.elements.send.disabled = true;
    out.status.textContent = "streaming…";
    try {
      const response = await fetch(form.dataset.endpoint, {
        method: "POST",
        credentials: "same-origin",
        headers: { "content-type": "application/json", "x-csrf-token": form.dataset.csrf },
        body: JSON.stringify(body),
      });
      if (!response.ok) {
        let message = response.status + " " + response.statusText;
        try {
          const err = await response.json();
          if (err.error && err.error.message) message = response.status + ": " + err.error.message;
        } catch (ignored) { /* not JSON */ }
        throw new Error(message);
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const record = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of record.split("\n")) {
            if (line.startsWith("data:") && handleEvent(line.slice(5).trim())) done = true;
          }
        }
      }
      finishToolCards();
      if (!out.status.textContent.startsWith("finish_reason")) out.status.textContent = "done";
    } catch (err) {
      out.status.textContent = "Error: " + err.message;
    } finally {
      form.elements.send.disabled = false;
    }
  }

  form.addEventListener("submit", send);
})();
