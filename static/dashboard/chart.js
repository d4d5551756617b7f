// Line charts drawn as SVG for the dashboard: time runs across the chart's window, values from
// 0 to a rounded maximum (0 to 1 for ratios), one line per series, a legend with the latest
// value of each. `kvspChart.draw(figure, series)` replaces what the figure showed before.
(function () {
  "use strict";

  const SVG = "http://www.w3.org/2000/svg";
  const WIDTH = 480;
  const HEIGHT = 170;
  const MARGIN = { left: 46, right: 10, top: 8, bottom: 20 };
  const COLORS = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed"];

  function svg(name, attributes, parent) {
    const element = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
    if (parent) parent.appendChild(element);
    return element;
  }

  // The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `value`.
  function roundedMaximum(value) {
    if (!(value > 0)) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (step * power >= value) return step * power;
    }
    return 10 * power;
  }

  function format(value, unit) {
    if (unit === "ratio") return `${Math.round(value * 100)}%`;
    if (unit === "ms") return value >= 1000 ? `${(value / 1000).toFixed(1)} s` : `${Math.round(value)} ms`;
    if (Math.abs(value) >= 10000) return `${(value / 1000).toFixed(0)}k`;
    if (Math.abs(value) >= 1000) return `${(value / 1000).toFixed(1)}k`;
    return Number.isInteger(value) ? String(value) : value.toFixed(1);
  }

  function clock(milliseconds) {
    const moment = new Date(milliseconds);
    return moment.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  function draw(figure, series) {
    const plot = figure.querySelector(".plot");
    const [start, end] = series.window;
    const unit = series.unit;
    const values = series.lines.flatMap((line) => line.points.map((point) => point[1]));
    const top = unit === "ratio" ? 1 : roundedMaximum(Math.max(0, ...values));
    const left = MARGIN.left;
    const right = WIDTH - MARGIN.right;
    const bottom = HEIGHT - MARGIN.bottom;
    const x = (time) => left + ((time - start) / Math.max(end - start, 1)) * (right - left);
    const y = (value) => bottom - (Math.min(value, top) / top) * (bottom - MARGIN.top);

    const chart = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img" });
    svg("title", {}, chart).textContent = figure.querySelector("figcaption")?.textContent || "";
    for (const fraction of [0, 0.5, 1]) {
      const level = y(top * fraction);
      svg("line", { x1: left, x2: right, y1: level, y2: level, class: fraction ? "grid" : "axis" }, chart);
      const label = svg("text", { x: left - 4, y: level + 3, "text-anchor": "end" }, chart);
      label.textContent = format(top * fraction, unit);
    }
    for (const [time, anchor] of [[start, "start"], [(start + end) / 2, "middle"], [end, "end"]]) {
      const label = svg("text", { x: x(time), y: HEIGHT - 4, "text-anchor": anchor }, chart);
      label.textContent = clock(time);
    }

    const legend = document.createElement("ul");
    legend.className = "legend";
    series.lines.forEach((line, position) => {
      const color = COLORS[position % COLORS.length];
      const points = line.points.filter(([time]) => time >= start && time <= end);
      if (points.length === 1) {
        const [time, value] = points[0];
        svg("circle", { cx: x(time), cy: y(value), r: 2.5, fill: color }, chart);
      } else if (points.length > 1) {
        const path = points.map(([time, value]) => `${x(time).toFixed(1)},${y(value).toFixed(1)}`);
        svg("polyline", { points: path.join(" "), class: "line", stroke: color }, chart);
      }
      const item = document.createElement("li");
      const swatch = document.createElement("i");
      swatch.style.background = color;
      const latest = points.length ? format(points[points.length - 1][1], unit) : "no data";
      item.append(swatch, `${line.name}: ${latest}`);
      legend.appendChild(item);
    });

    if (!values.length) {
      const empty = svg("text", { x: (left + right) / 2, y: HEIGHT / 2, "text-anchor": "middle" }, chart);
      empty.textContent = "nothing recorded in this window";
    }
    plot.replaceChildren(chart, legend);
  }

  window.kvspChart = { draw };
})();
