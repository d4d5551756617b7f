// Live refresh of a dashboard page. The page's <main data-live="URL"> names its JSON twin,
// which answers {html: {section: markup}, series: {chart: lines}, append: {list: markup},
// cursor: {...}}. Sections are patched in place rather than replaced, so a button being
// clicked, a box being ticked or a text being selected survives a refresh; lists such as a
// session's tokens grow by what is new since the cursor; charts are redrawn.
(function () {
  "use strict";

  // Forms that ask before they act (drain, withdraw, abort).
  document.addEventListener("submit", (event) => {
    const question = event.target.dataset.confirm;
    if (question && !window.confirm(question)) event.preventDefault();
  });

  // A box that ticks or clears every box of its form.
  document.addEventListener("change", (event) => {
    if (!event.target.matches("[data-select-all]")) return;
    for (const box of event.target.form.querySelectorAll('input[type="checkbox"][name]')) {
      box.checked = event.target.checked;
    }
  });

  const main = document.querySelector("main[data-live]");
  if (!main) return;
  const status = document.querySelector("[data-live-status]");
  const interval = Number(main.dataset.interval) || 2000;
  const cursor = main.dataset.cursor ? JSON.parse(main.dataset.cursor) : {};
  const received = new Map();

  function say(text, stale) {
    if (!status) return;
    status.textContent = text;
    status.classList.toggle("stale", Boolean(stale));
  }

  // Make `current` look like `next`, keeping every element whose tag is unchanged. Only
  // attributes are copied, never properties, so a ticked box stays ticked.
  function morph(current, next) {
    if (current.nodeType !== next.nodeType || current.nodeName !== next.nodeName) {
      current.replaceWith(next.cloneNode(true));
      return;
    }
    if (current.nodeType === Node.TEXT_NODE || current.nodeType === Node.COMMENT_NODE) {
      if (current.nodeValue !== next.nodeValue) current.nodeValue = next.nodeValue;
      return;
    }
    if (current.nodeType !== Node.ELEMENT_NODE) return;
    for (const { name } of Array.from(current.attributes)) {
      if (!next.hasAttribute(name)) current.removeAttribute(name);
    }
    for (const { name, value } of Array.from(next.attributes)) {
      if (current.getAttribute(name) !== value) current.setAttribute(name, value);
    }
    morphChildren(current, next);
  }

  function morphChildren(current, next) {
    const have = Array.from(current.childNodes);
    const want = Array.from(next.childNodes);
    want.forEach((node, position) => {
      if (position < have.length) morph(have[position], node);
      else current.appendChild(node.cloneNode(true));
    });
    for (const extra of have.slice(want.length)) extra.remove();
  }

  function patch(name, html) {
    if (received.get(name) === html) return;
    received.set(name, html);
    const target = main.querySelector(`[data-section="${name}"]`);
    if (!target) return;
    const next = document.createElement("div");
    next.innerHTML = html;
    morphChildren(target, next);
  }

  function append(name, html) {
    const target = main.querySelector(`[data-append="${name}"]`);
    if (target) target.insertAdjacentHTML("beforeend", html);
  }

  async function refresh() {
    let wait = interval;
    try {
      const query = new URLSearchParams(cursor).toString();
      const response = await fetch(main.dataset.live + (query ? `?${query}` : ""), {
        headers: { Accept: "application/json" },
        cache: "no-store",
        credentials: "same-origin",
      });
      if (response.status === 403) {
        say("Logged out: reload the page to log in again.", true);
        return;
      }
      if (!response.ok) throw new Error(`the server answered ${response.status}`);
      const data = await response.json();
      for (const [name, html] of Object.entries(data.html || {})) patch(name, html);
      for (const [name, html] of Object.entries(data.append || {})) append(name, html);
      Object.assign(cursor, data.cursor || {});
      for (const [name, series] of Object.entries(data.series || {})) {
        const figure = main.querySelector(`[data-chart="${name}"]`);
        if (figure) window.kvspChart.draw(figure, series);
      }
      say(`Live · ${new Date(data.generated_at).toLocaleTimeString()}`);
    } catch (error) {
      say(`Not updating (${error.message}); trying again`, true);
      wait = interval * 3;
    }
    window.setTimeout(refresh, wait);
  }

  refresh();
})();
