"""check_ep's scenarios, the routing training produces: ``catalogue`` (the table, without torch),
``routing`` (the routings that are not uniform), ``runner`` (each scenario run and checked on
this rank). See docs/probes.md, section "Scenarios"."""
