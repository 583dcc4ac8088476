"""The operations a communicator offers: reductions, data movement, point-to-point messages."""
