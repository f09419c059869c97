"""Reports for people to look at: `opadvisor report` builds one self-contained HTML page from a run.

The analysis is `opadvisor.rules` (the same Report `suggest` renders, the step breakdown, one step's
timeline, the cross-rank view); this package only lays it out: `html.build_html` returns the page.
"""
