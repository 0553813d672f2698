"""Where a node group may run besides where it is declared, and the broker that moves it there
(docs/capacity.md): `places` (the candidates resolved), `checks` (the spec's rules for them),
`pricing` (each candidate's $/h and what a move copies), `broker` (the watch loop behind
`python -m infra.capacity watch`), `workspace` (the Automation API behind a small interface),
`transfer` (the checkpoint and dataset copy, verified). The per-cloud calls (stock, quota, launch
failures) are infra/clouds/<cloud>/stock.py."""
