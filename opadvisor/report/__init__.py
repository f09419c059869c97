"""Reports of a run, built here and printed by the CLI.

`findings` is the report `opadvisor suggest` prints (the run's findings ranked, the JSON contract
document, the table's text), `sarif` the same as SARIF 2.1.0; `html` is `opadvisor report`'s one
self-contained page (`html.build_html`), `svg` its charts, `timeline` one step's timeline they draw;
`diff` is `opadvisor diff`'s comparison of two runs. The analysis is `opadvisor.rules` (the Report, the
step breakdown) and `opadvisor.ranks` (the cross-rank view); this package lays it out.
"""
