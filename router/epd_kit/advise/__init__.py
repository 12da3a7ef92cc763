"""epd_kit.advise: the layout advisor (`epd-router advise`, docs/advisor.md).

Two scrapes of the router's metrics taken N seconds apart say where a request's time went; a
stated queueing model fitted to them says which VE:PD split of the same hosts and cores would
serve the measured load better; the planner itself checks that split. Layout:

    scrape     metric samples from router URLs, a Prometheus server or saved scrape files
    window     what changed between two scrapes (counters, histograms) and the engines seen
    queueing   the M/M/c model: Erlang C, fitting a service time, predicting a pool
    analysis   per-pool figures, TTFT shares, the verdict and its confidence
    layout     candidate layouts, checked by the planner and the rollout floors
    report     the printed report
    cli        the `advise` command

The advisor only reads: it changes nothing; the operator applies a recommendation through the
inventory and deploy.yml (the rolling change).
"""
