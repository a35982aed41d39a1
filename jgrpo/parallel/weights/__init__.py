"""The weight transport: how a version of the sampler's weights gets from where it trains to where it samples.

Within one job (`copies.py`): a copy in the sampler's dtype and layout on the same devices, on a sub-mesh of the
same processes (`device_put`), or on the sampler's own processes (`process_crossing.py`, one collective).
To another job (`rollout.role`): in buckets over the TCP channel (`buckets.py`), or device to device
(`device_transfer.py`, `rollout.weight_transfer: jax`).
"""
