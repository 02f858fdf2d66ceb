"""Running a plan: placement, actor launch, the run loop, cluster, engine builds, failures."""
