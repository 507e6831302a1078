// The console's only script: a confirm dialog before destructive forms, and the live
// overview (server-sent HTML fragments, escaped on the server). Pages work without it.
"use strict";

document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.getAttribute && form.getAttribute("data-confirm");
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("live");
  if (!live || !window.EventSource) {
    return;
  }
  const source = new EventSource(live.getAttribute("data-events"));
  source.addEventListener("overview", (event) => {
    live.innerHTML = JSON.parse(event.data).html;
  });
});
