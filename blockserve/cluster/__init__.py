"""Scale-out: many engine replicas behind one prefix-aware router (Ray Serve on top)."""
