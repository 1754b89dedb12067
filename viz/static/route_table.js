// The request slider and route table of a ReplicaCacheView (viz/replicas.py): an anywidget
// ES module with no dependencies and no build.
//
// `routes` holds one row per request ({replica, prompt, prompt_tokens, cached_tokens}),
// `colours` one colour per replica, `value` the request shown. Moving the slider sets `value`,
// and `ipywidgets.jslink` carries it to every replica's player (its `mark` trait): the trees
// follow in the browser alone, so the slider works from the notebook's saved widget state
// before any kernel runs.

function htmlEl(tag, cls, parent, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

function render({ model, el }) {
  const root = htmlEl("div", "rv-routes", el);
  root.style.fontFamily = "Helvetica, Arial, sans-serif";
  root.style.fontSize = "12px";
  const bar = htmlEl("label", "rv-routes-bar", root);
  bar.style.display = "flex";
  bar.style.alignItems = "center";
  bar.style.gap = "8px";
  htmlEl("span", "", bar, "request");
  const slider = htmlEl("input", "rv-route-slider", bar);
  slider.type = "range";
  slider.min = 0;
  slider.step = 1;
  slider.style.flex = "1";
  slider.style.maxWidth = "420px";
  const table = htmlEl("table", "rv-route-table", root);
  table.style.borderCollapse = "collapse";

  function draw() {
    const routes = model.get("routes") || [];
    const colours = model.get("colours") || [];
    const value = model.get("value");
    slider.max = Math.max(0, routes.length - 1);
    slider.value = value;
    slider.disabled = routes.length === 0;
    table.replaceChildren();
    const head = htmlEl("tr", "", table);
    for (const h of ["request", "prompt", "replica", "cached / prompt"]) htmlEl("th", "", head, h);
    if (!routes.length) {
      const td = htmlEl("td", "", htmlEl("tr", "", table), "no request yet");
      td.colSpan = 4;
      return;
    }
    routes.forEach((r, k) => {
      const tr = htmlEl("tr", k === value ? "rv-route current" : "rv-route", table);
      if (k === value) tr.style.background = "#fff6e0";
      htmlEl("td", "", tr, String(k));
      htmlEl("td", "", tr, r.prompt);
      const cell = htmlEl("td", "", tr);
      const mark = htmlEl("b", "", cell, "\u25a0");
      mark.style.color = colours[r.replica % colours.length] || "#000";
      cell.append(` ${r.replica}`);
      htmlEl("td", "", tr, `${r.cached_tokens} / ${r.prompt_tokens}`);
    });
  }

  slider.addEventListener("input", () => {
    const v = Number(slider.value);
    if (v === model.get("value")) return;
    model.set("value", v);
    model.save_changes();
    draw();
  });
  model.on("change:value", draw);
  model.on("change:routes", draw);
  draw();
  return () => {
    model.off("change:value", draw);
    model.off("change:routes", draw);
  };
}

export default { render };
