"""`rlhfkit label`: people compare two responses to a prompt in a local web page, and their judgements become
preference data (`rlhfkit rm`, `rlhfkit dpo`), a blind human win rate of one model against another, and harmful
flags for the red-team report.

- `candidates`: the items to judge, from a file of ready-made responses or sampled once from one model (k per
  prompt) or two (compare mode), as typed `Pair`s.
- `store`: SQLite in WAL mode; who gets which item, every judgement committed before the page hears it was saved.
- `app`: the Starlette routes; `static/` the page (plain HTML and JS).
- `guard`: what the server refuses before any route (another site's Host, Origin or write, a body over the cap)
  and the access tokens, shared or one per person.
- `export`: preference rows and harmful-flag rows; `figures`: agreement, Cohen's kappa, the human win rate.
- `command`: the CLI's `rlhfkit label`, which wires them together.
"""
