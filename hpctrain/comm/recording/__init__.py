"""What the communicator records: the timeline of phases and the communication log's totals."""
