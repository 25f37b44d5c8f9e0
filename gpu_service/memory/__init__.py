"""The service's bookkeeping of what its sequences hold: each sequence's host record
(`sequence.py`), the slot and session tables, the paged KV pool's blocks and the prefix
snapshots.

May import `gpu_service.model` (the device state it points into) and below."""
