"""The world's runtime and life: lanes, watchdog, failure policy, failed and departed ranks, ending a job."""
