-- Occurrence counters live in the kernel's memory from version 2 on: they only
-- count the effects of the current dispatch attempt, and a kernel restart
-- retires every lease granted before it, so nothing needs them after a restart.
DROP TABLE step_counters;
