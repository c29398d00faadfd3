"""Deployment sweeps and search: simulate a grid of configs in parallel (``sweep``), and find the cheapest
deployment that meets TTFT/TPOT SLOs at a target rate (``search``: enumerate, prune with the queueing model
and the incumbent, bisect each survivor's max SLO rate with an on-disk cache, Pareto front of $/h vs goodput).
"""
