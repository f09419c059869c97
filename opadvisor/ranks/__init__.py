"""Multi-rank runs, read across their ranks: step time per rank, stragglers, communication and its overlap.

    from opadvisor.ranks import cross_rank
    report = cross_rank.analyse(profiles)   # the per-rank profiles of one run

The single-rank rules run on every rank (`opadvisor.rules.engine`); this package compares the ranks.
"""
