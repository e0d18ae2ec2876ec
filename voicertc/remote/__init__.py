"""The engine as a Ray Serve deployment, and the front-end's client of it (`engine.backend = "ray"`).

- `wire`: what crosses between a front-end and a replica (versions, message shapes). No Ray import.
- `client.RemoteEngine`: the `voicertc.engine.protocol.Engine` seam; utterances, rings, events. No Ray
  import: the front-end process never joins the cluster.
- `link.DriverLink`: the front-end's end of its Ray driver child process (socketpair, pickled frames).
- `driver`: that child (`python -m voicertc.remote.driver`): deployment handle, health probes, voices.
- `connect`: joining the cluster (token auth, "auto" addresses, the GCS probe).
- `deployment`: the replica (today's EngineWorker + backend) and `build_app(config)`.
- `router.SessionAffinityRouter` + `affinity`: all utterances of one call on one replica (in the driver).

`driver`, `deployment`, `router` and `cli` import Ray (the `scale` extra); in-process engines never do.
"""
