"""Device meshes, the regex sharding rules applied to parameters, and sharded attention."""
