// The playground: the service's own HTTP API from the browser, and its attention maps.
"use strict";

const $ = (id) => document.getElementById(id);

// weights: [layer][head][row][column]; layer or head "avg" averages over that axis.
function attentionMatrix(weights, layer, head) {
  const layers = layer === "avg" ? weights : [weights[Number(layer)]];
  const rows = layers[0][0].length, columns = layers[0][0][0].length;
  const matrix = Array.from({ length: rows }, () => new Array(columns).fill(0));
  let count = 0;
  for (const heads of layers) {
    for (const grid of head === "avg" ? heads : [heads[Number(head)]]) {
      count += 1;
      grid.forEach((row, i) => row.forEach((value, j) => { matrix[i][j] += value; }));
    }
  }
  return matrix.map((row) => row.map((value) => value / count));
}

function fillSelect(select, count, label) {
  const previous = select.value;
  select.replaceChildren();
  for (let i = 0; i < count; i += 1) select.add(new Option(`${label} ${i + 1}`, String(i)));
  select.add(new Option("average", "avg"));
  select.value = [...select.options].some((o) => o.value === previous) ? previous : "avg";
}

function shade(value) {
  return `rgba(37, 99, 235, ${Math.min(1, value).toFixed(3)})`;
}

function tokenChip(text) {
  const chip = document.createElement("span");
  chip.className = "token";
  chip.textContent = text.replace(/\n/g, "\u21b5");  // a line break shows as a return sign
  return chip;
}

// JSON headers, with the API key as a Bearer token when one is filled in.
function jsonHeaders() {
  const key = $("api-key").value.trim();
  return key ? { "Content-Type": "application/json", Authorization: `Bearer ${key}` } : { "Content-Type": "application/json" };
}

async function postJSON(path, body) {
  const response = await fetch(path, { method: "POST", headers: jsonHeaders(), body: JSON.stringify(body) });
  const answer = await response.json();
  if (!response.ok) throw Object.assign(new Error(answer.error ? answer.error.message : response.statusText), { param: answer.error && answer.error.param });
  return answer;
}

// ---- Translate ----
let sentences = [];

async function translate() {
  const button = $("translate-button");
  button.disabled = true;
  $("translate-status").textContent = "translating...";
  const body = { model: $("translate-model").value || undefined, text: $("source").value, beam_size: Number($("beam-size").value), alternatives: Number($("alternatives").value), return_attention: true };
  if (body.alternatives >= body.beam_size) body.alternatives = body.beam_size - 1;
  try {
    let answer;
    try {
      answer = await postJSON("/v1/translate", body);
    } catch (error) {
      if (error.param !== "return_attention") throw error;
      answer = await postJSON("/v1/translate", { ...body, return_attention: false });  // too many sentences to show attention
    }
    showTranslation(answer.translations[0]);
    $("translate-status").textContent = "";
  } catch (error) {
    $("translate-status").textContent = `error: ${error.message}`;
  } finally {
    button.disabled = false;
  }
}

function showTranslation(translation) {
  const output = $("translation");
  output.replaceChildren(document.createTextNode(translation.text));
  translation.alternatives.forEach((text, i) => {
    const line = document.createElement("div");
    line.className = "alternative";
    line.textContent = `alternative ${i + 1}: ${text}`;
    output.append(line);
  });
  sentences = translation.sentences.filter((s) => s.attention);
  $("attention-view").hidden = sentences.length === 0;
  if (sentences.length === 0) return;
  const select = $("sentence-select");
  select.replaceChildren(...sentences.map((s, i) => new Option(`${i + 1}: ${s.text}`, String(i))));
  fillSelect($("cross-layer"), sentences[0].attention.layers, "layer");
  fillSelect($("cross-head"), sentences[0].attention.heads, "head");
  drawHeatmap();
}

function drawHeatmap() {
  const attention = sentences[Number($("sentence-select").value)].attention;
  const matrix = attentionMatrix(attention.weights, $("cross-layer").value, $("cross-head").value);
  const sourceChips = attention.source_tokens.map(tokenChip);
  $("source-tokens").replaceChildren(...sourceChips);
  const table = document.createElement("table");
  const head = table.createTHead().insertRow();
  head.append(document.createElement("th"));
  for (const token of attention.source_tokens) {
    const th = document.createElement("th");
    th.textContent = token;
    head.append(th);
  }
  const body = table.createTBody();
  matrix.forEach((row, i) => {
    const tr = body.insertRow();
    const th = document.createElement("th");
    th.textContent = attention.target_tokens[i];
    tr.append(th);
    row.forEach((value) => {
      const td = tr.insertCell();
      td.style.background = shade(value);
      td.title = value.toFixed(3);
    });
    tr.addEventListener("mouseenter", () => row.forEach((value, j) => { sourceChips[j].style.background = shade(value); }));
    tr.addEventListener("mouseleave", () => sourceChips.forEach((chip) => { chip.style.background = ""; }));
  });
  $("heatmap").replaceChildren(table);
}

// ---- Generate ----
let selfAttention = null;
let selectedToken = null;
// Chat mode: the conversation so far (each Generate sends the box as the next user message).
let conversation = [];
const transcript = (messages) => messages.map((m) => `${m.role}: ${m.content}\n`).join("");

async function generate() {
  const button = $("generate-button");
  button.disabled = true;
  $("self-attention-view").hidden = true;
  const prompt = $("prompt").value;
  const chat = $("chat-mode").checked;
  if (chat) conversation.push({ role: "user", content: prompt });
  const shown = chat ? `${transcript(conversation)}assistant: ` : prompt;  // what the output shows before the new text
  const output = $("generated");
  output.textContent = "";
  for (const id of ["ttft", "tokens-per-s"]) $(id).textContent = "-";
  $("token-count").textContent = "0";
  const started = performance.now();
  let firstToken = null, text = "";
  try {
    const schemaText = $("json-schema").value.trim();
    let responseFormat;
    if (schemaText) {
      try {
        responseFormat = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schemaText) } };
      } catch (error) {
        throw new Error(`the JSON schema is not JSON: ${error.message}`);
      }
    }
    const response = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST",
      headers: jsonHeaders(),
      body: JSON.stringify({
        model: $("generate-model").value || undefined, ...(chat ? { messages: conversation } : { prompt }),
        stream: true, stream_options: { include_usage: true, continuous_usage_stats: true },
        temperature: Number($("temperature").value), top_p: Number($("top-p").value),
        max_tokens: Number($("max-tokens").value), seed: Number($("seed").value), response_format: responseFormat,
      }),
    });
    if (!response.ok) throw new Error((await response.json()).error.message);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const frame = JSON.parse(data);
        if (frame.error) throw new Error(frame.error.message);
        const piece = frame.choices.length ? (chat ? frame.choices[0].delta.content : frame.choices[0].text) : "";
        if (piece) {
          if (firstToken === null) {
            firstToken = performance.now();
            $("ttft").textContent = `${Math.round(firstToken - started)} ms`;
          }
          text += piece;
          output.textContent = shown + text;
        }
        if (frame.usage) {
          const tokens = frame.usage.completion_tokens;
          $("token-count").textContent = String(tokens);
          const seconds = (performance.now() - started) / 1000;
          if (seconds > 0) $("tokens-per-s").textContent = (tokens / seconds).toFixed(1);
        }
      }
    }
    if (chat) conversation.push({ role: "assistant", content: text });
    else await showSelfAttention(prompt + text);
  } catch (error) {
    if (chat) conversation.pop();  // the message that failed is not part of the conversation
    output.textContent += `\n[error: ${error.message}]`;
  } finally {
    button.disabled = false;
  }
}

async function showSelfAttention(text) {
  selfAttention = await postJSON("/v1/attention", { model: $("generate-model").value || undefined, text });
  fillSelect($("self-layer"), selfAttention.layers, "layer");
  fillSelect($("self-head"), selfAttention.heads, "head");
  selectedToken = selfAttention.tokens.length - 1;
  $("self-attention-view").hidden = false;
  drawSelfAttention();
}

function drawSelfAttention() {
  const matrix = attentionMatrix(selfAttention.weights, $("self-layer").value, $("self-head").value);
  const row = matrix[selectedToken];
  const chips = selfAttention.tokens.map((token, j) => {
    const chip = tokenChip(token);
    if (j === selectedToken) chip.classList.add("selected");
    else if (j < selectedToken) chip.style.background = shade(row[j]);
    chip.title = j <= selectedToken ? row[j].toFixed(3) : "";
    chip.addEventListener("click", () => { selectedToken = j; drawSelfAttention(); });
    return chip;
  });
  $("self-tokens").replaceChildren(...chips);
}

// ---- Models: the served translators (with their languages) and generators, from /v1/models ----
async function loadModels() {
  const response = await fetch("/v1/models", { headers: jsonHeaders() });
  if (!response.ok) return;  // e.g. a key is needed: the server's default models serve
  const models = (await response.json()).data;
  const fill = (select, kind, label) => {
    const previous = select.value;
    select.replaceChildren(...models.filter((m) => m.kind === kind).map((m) => new Option(label(m), m.id)));
    if ([...select.options].some((o) => o.value === previous)) select.value = previous;
  };
  fill($("translate-model"), "translator", (m) => `${m.id} (${m.source_lang} \u2192 ${m.target_lang})`);
  fill($("generate-model"), "generator", (m) => m.id);
}

loadModels();
$("api-key").addEventListener("change", loadModels);
$("translate-button").addEventListener("click", translate);
$("generate-button").addEventListener("click", generate);
for (const id of ["chat-mode", "generate-model"]) $(id).addEventListener("change", () => { conversation = []; });
for (const id of ["sentence-select", "cross-layer", "cross-head"]) $(id).addEventListener("change", drawHeatmap);
for (const id of ["self-layer", "self-head"]) $(id).addEventListener("change", drawSelfAttention);
