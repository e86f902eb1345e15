/**
 * The dialog that asks for the service's API key: `keyDialog(elements, currentKey)` returns
 * `ask(reason)`, which resolves to the key typed in, or null when the user gives up.
 */

export function keyDialog({ dialog, form, input, reason, cancel }, currentKey) {
  return (text) =>
    new Promise((resolve) => {
      reason.textContent = text;
      input.value = currentKey();
      const finish = (value) => {
        dialog.removeEventListener("close", onClose);
        form.removeEventListener("submit", onSubmit);
        cancel.removeEventListener("click", onCancel);
        if (dialog.open) dialog.close();
        resolve(value);
      };
      const onSubmit = (event) => {
        event.preventDefault();
        finish(input.value.trim() || null);
      };
      const onCancel = () => finish(null);
      const onClose = () => finish(null);
      form.addEventListener("submit", onSubmit);
      cancel.addEventListener("click", onCancel);
      dialog.addEventListener("close", onClose);
      dialog.showModal();
      input.focus();
    });
}
