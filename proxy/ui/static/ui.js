// stackpin audit page: small conveniences over pages that work without script.
//  - a form that starts a replay or a probe says so and cannot be sent twice;
//  - [data-copy] buttons copy a full id or fingerprint.

for (const form of document.querySelectorAll("form[data-busy]")) {
  form.addEventListener("submit", () => {
    for (const button of form.querySelectorAll("button[type=submit]")) {
      button.disabled = true;
      button.textContent = form.dataset.busy;
    }
  });
}

for (const button of document.querySelectorAll("button[data-copy]")) {
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(button.dataset.copy);
      button.textContent = "copied";
    } catch {
      button.textContent = "select it";
    }
    setTimeout(() => { button.textContent = "copy"; }, 1200);
  });
}
