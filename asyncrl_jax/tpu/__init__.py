"""Planning for Cloud TPU slices on a machine without one: the generations' figures (``chips``), the
TPU compiler's view of every per-step program of a config (``compile``), and the cost, memory and
collectives read off its optimized HLO (``hlo``)."""
