// healthbot agent console: plain JS, no build step (adapters/console.py documents the API).
// Every text from the server is rendered with textContent, never as HTML.
"use strict";

const POLL_MS = 2000; // list and open conversation refresh every 2 s
const TOKEN_KEY = "healthbot-console-token"; // sessionStorage: gone when the tab closes
const WHO = { user: "用户 / user", bot: "机器人 / bot", agent: "客服 / agent" };
const REASONS = { user_request: "用户请求 / user request", emergency: "紧急 / emergency", no_answer: "未答出 / no answer" };

const $ = (id) => document.getElementById(id);
let selected = null; // ref of the open conversation
let busy = false;    // one refresh at a time
let lastTranscript = "";
let refreshFailed = false; // a refresh error is shown until a refresh works again

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function status(text, isError) {
  $("status").textContent = text || "";
  $("status").className = isError ? "error" : "";
}

function when(unixS) {
  return new Date(unixS * 1000).toLocaleTimeString();
}

class Unauthorized extends Error {}

async function api(path, body) {
  const opts = { headers: { Authorization: "Bearer " + sessionStorage.getItem(TOKEN_KEY) }, cache: "no-store" };
  if (body !== undefined) {
    opts.method = "POST";
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const resp = await fetch("/console/api/" + path, opts);
  let data = {};
  try { data = await resp.json(); } catch (e) { data = { error: resp.statusText }; }
  if (resp.status === 401) throw new Unauthorized(data.error || "unauthorized");
  if (!resp.ok) {
    const err = new Error(data.error || ("HTTP " + resp.status));
    err.status = resp.status;
    throw err;
  }
  return data;
}

function showDesk(on) {
  $("login").hidden = on;
  $("desk").hidden = !on;
  $("sign-out").hidden = !on;
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  selected = null;
  showDesk(false);
  status(message, Boolean(message));
}

function renderList(handoffs) {
  const list = $("handoffs");
  list.replaceChildren();
  $("count").textContent = "(" + handoffs.length + ")";
  $("empty").hidden = handoffs.length > 0;
  for (const h of handoffs) {
    const item = el("li");
    const button = el("button");
    button.type = "button";
    button.dataset.ref = h.ref;
    button.dataset.channel = h.channel;
    button.setAttribute("aria-current", String(h.ref === selected));
    button.append(el("strong", h.label), document.createTextNode(" · " + (REASONS[h.reason] || h.reason)));
    button.append(el("span", h.last, "last"));
    button.addEventListener("click", () => { selected = h.ref; lastTranscript = ""; refresh(); });
    item.append(button);
    list.append(item);
  }
}

function renderConversation(c) {
  $("conversation").hidden = false;
  $("conv-title").textContent = c.label;
  $("conv-meta").textContent = (REASONS[c.reason] || c.reason) + " · 开始 / started " + when(c.started_at)
    + " · 最近 / last " + when(c.last_activity);
  $("reply-text").disabled = !c.can_reply;
  $("send").disabled = !c.can_reply;
  $("reply-note").hidden = c.can_reply;
  $("reply-note").textContent = c.reply_note || "";
  const key = JSON.stringify(c.transcript);
  if (key === lastTranscript) return; // keep the scroll position while nothing changed
  lastTranscript = key;
  const list = $("transcript");
  list.replaceChildren();
  for (const turn of c.transcript) {
    const item = el("li", undefined, turn.who);
    item.append(el("span", WHO[turn.who] || turn.who, "who"), el("span", turn.text, "text"));
    list.append(item);
  }
  list.scrollTop = list.scrollHeight;
}

function closeConversation(message) {
  selected = null;
  lastTranscript = "";
  $("conversation").hidden = true;
  if (message) status(message);
}

async function refresh() {
  if (busy || !sessionStorage.getItem(TOKEN_KEY)) return;
  busy = true;
  try {
    const data = await api("handoffs");
    renderList(data.handoffs);
    if (selected) {
      try {
        renderConversation(await api("handoffs/" + encodeURIComponent(selected)));
      } catch (e) {
        if (e.status === 404) closeConversation("对话已结束 / The conversation has ended.");
        else throw e;
      }
    }
    if (refreshFailed) { refreshFailed = false; status(""); }
  } catch (e) {
    if (e instanceof Unauthorized) signOut("令牌错误 / Wrong console token.");
    else { refreshFailed = true; status("刷新失败 / Refresh failed: " + e.message, true); }
  } finally {
    busy = false;
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("reply-text").value.trim();
  if (!text || !selected) return;
  $("send").disabled = true;
  try {
    await api("handoffs/" + encodeURIComponent(selected) + "/reply", { text });
    $("reply-text").value = "";
    status("已发送 / Sent.");
  } catch (e) {
    if (e instanceof Unauthorized) return signOut("令牌错误 / Wrong console token.");
    status("发送失败 / Not sent: " + e.message, true);
  } finally {
    $("send").disabled = false;
  }
  refresh();
}

async function closeHandoff() {
  if (!selected) return;
  try {
    await api("handoffs/" + encodeURIComponent(selected) + "/close", {});
    closeConversation("对话已结束，用户已收到通知 / Closed; the user was told.");
  } catch (e) {
    if (e instanceof Unauthorized) return signOut("令牌错误 / Wrong console token.");
    status("结束失败 / Not closed: " + e.message, true);
  }
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    showDesk(true);
    status("");
    refresh();
  });
  $("sign-out").addEventListener("click", () => signOut(""));
  $("reply-form").addEventListener("submit", send);
  $("close").addEventListener("click", closeHandoff);
  if (sessionStorage.getItem(TOKEN_KEY)) { showDesk(true); refresh(); }
  setInterval(refresh, POLL_MS);
});
