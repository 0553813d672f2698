"""The stack spec: the typed, frozen model of a stack file (spec.py and its parts), its text and
patterns, the problems it names, and what follows from the spec alone (tags, images, node
pools, scrape sources). Imports core and the cloud profiles (infra/clouds, plain data).

Modules: spec, spec_base, spec_capacity, spec_patterns, spec_problems, stacktext, tags, images, pools, scrape."""
