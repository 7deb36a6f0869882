"""Running the job's own batch script again from a checkpoint (a recovery's relaunch, a
continuation drill's run): how it is started and watched, whether its arguments fit the
checkpoint, and whether it went on as the run before it did."""
