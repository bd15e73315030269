"""The HTML report's stylesheet: one column on narrow screens, figures beside plots on laptops."""

CSS = """
:root { --ink: #1d2430; --muted: #5b6575; --rule: #dfe3ea; --accent: #1f77b4; --bad: #b42318; }
* { box-sizing: border-box; }
body { margin: 0; background: #f6f7f9; color: var(--ink);
  font: 15px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { margin: 0; font-size: 26px; }
h2 { margin: 0 0 12px; font-size: 19px; }
.sub { margin: 4px 0 16px; color: var(--muted); }
nav { display: flex; flex-wrap: wrap; gap: 6px 14px; margin-bottom: 18px; font-size: 13px; }
nav a { color: var(--accent); text-decoration: none; }
.tiles { display: grid; grid-template-columns: repeat(auto-fit, minmax(160px, 1fr)); gap: 12px;
  margin-bottom: 18px; }
.tile { background: #fff; border: 1px solid var(--rule); border-radius: 8px; padding: 12px 14px; }
.tile .v { font-size: 24px; font-weight: 600; }
.tile .k { color: var(--muted); font-size: 13px; }
section { background: #fff; border: 1px solid var(--rule); border-radius: 8px;
  padding: 18px 20px; margin-bottom: 18px; }
.cols { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1.15fr); gap: 20px;
  align-items: start; }
.pair { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px 28px;
  align-items: start; }
@media (max-width: 900px) { .cols, .pair { grid-template-columns: minmax(0, 1fr); } }
table.narrow { max-width: 560px; }
table { border-collapse: collapse; width: 100%; font-size: 14px; margin-bottom: 12px; }
th, td { padding: 4px 8px; border-bottom: 1px solid var(--rule); text-align: right;
  vertical-align: top; white-space: nowrap; }
td.digest, table.fields td:last-child { white-space: normal; }
th:first-child, td:first-child { text-align: left; }
th { color: var(--muted); font-weight: 600; }
td.text { text-align: left; }
table.fields td:last-child { font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
td { font-variant-numeric: tabular-nums; }
.term { text-decoration: underline dotted #9aa3b2; cursor: help; }
.note { color: var(--muted); font-size: 12px; }
.caption { color: var(--muted); font-size: 13px; margin: -6px 0 10px; }
figure { margin: 0; }
figure img { display: block; width: 100%; height: auto; }
figure.wide { margin-top: 8px; }
.failed td { color: var(--bad); }
.digest { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
dl { margin: 0; display: grid; grid-template-columns: minmax(140px, 220px) 1fr; gap: 6px 16px;
  font-size: 14px; }
dt { font-weight: 600; }
dd { margin: 0; color: #333b48; }
"""
