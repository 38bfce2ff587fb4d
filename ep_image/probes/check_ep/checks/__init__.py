"""The checks of check_ep that run the backend's kernels, one step a module: dispatch_combine,
backward, replay, scenarios, bandwidth; each compares every output with the reference
(``check_ep.reference``) and merges its verdict over the ranks. See docs/probes.md, "Steps"."""
