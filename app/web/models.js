/**
 * The model picker for new conversations: the models of GET /api/models, shown when there is more
 * than one to choose from. A conversation keeps the model it was made with (agent.model).
 */

/** Fill `select` with the models; its `label` shows only when there is a choice. */
export async function fillModelPicker(api, select, label) {
  let models = [];
  try {
    models = (await api.listModels()) ?? [];
  } catch {
    // The picker is a convenience: without it new conversations take the default model.
  }
  const previous = select.value;
  select.replaceChildren(
    ...models.map((model) => {
      const option = document.createElement("option");
      option.value = model.name;
      option.textContent = model.default ? `${model.name} (default)` : model.name;
      option.title = model.model;
      if (model.default) option.dataset.default = "yes";
      option.selected = previous ? model.name === previous : Boolean(model.default);
      return option;
    }),
  );
  label.hidden = models.length < 2;
}

/** The model a new conversation asks for: null for the default (or no choice shown), so that the
 * conversation follows the service's default as the API's and the CLI's do. */
export function pickedModel(select, label) {
  const option = select.selectedOptions[0];
  return label.hidden || !option || option.dataset.default === "yes" ? null : option.value;
}
