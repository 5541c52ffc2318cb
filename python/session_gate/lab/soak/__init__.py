"""``make soak``: the whole system under load and faults, bounded to a few minutes on loopback.

Two CPU ``vllm serve`` replicas with the plugin and ``session-gate proxy`` in front
(``cluster``); a few hundred concurrent sessions from the ``openai`` client (``sessions``); and,
while they run, one replica killed (SIGKILL) and later restarted at its address, clients
dropping streams and abandoning sessions, retry storms, and bad input to every route
(``bad_input``). The report (``run``) counts every turn's fate, the leases and reservations the
gates still hold once every session finished or its grace ended, the proxy's RSS at start,
middle and end, and whether every engine still serves; the last line printed is JSON."""
