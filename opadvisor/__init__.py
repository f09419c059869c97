"""opadvisor: find where a PyTorch training script loses GPU time, fix it, and prove the fix."""

__version__ = "0.1.0"


def step() -> None:
    """Mark the end of one training step, for loops that do not call a torch optimizer.

    Outside `opadvisor profile` this does nothing, so scripts can keep the call.
    """
    from opadvisor.profile import session

    session.mark_step()
