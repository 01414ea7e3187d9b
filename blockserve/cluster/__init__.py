"""Scale-out: many engine replicas behind one prefix-aware router (Ray Serve on top).

Modules:

  routing.py    what a policy sees: RouteRequest (route_request), ReplicaLoad, the protocol
  policies.py   the kv policy (overlap against queued blocks), make_policy
  baselines.py  pow2, round-robin, text-prefix
  index.py      PrefixIndex: a replica's mirror (from its events) plus credits
  config.py     ClusterConfig (--replicas, --router, ...)
  replica.py    EngineReplica: an AsyncEngine in a Serve replica, events advertised
  client.py     ClusterEngineClient: the ingress's EngineClient over the replicas
  router.py     PolicyRouter, KVCacheAwareRouter (Ray Serve RequestRouters)
  registry.py   the routers running in this process, for GET /cluster/replicas
  app.py        the Serve application: deployments, build_app for `serve run`
  launch.py     `blockserve serve --replicas N`
"""
