"""``shardckpt demo``: the main job (``job``), the training ranks it runs (``train``, ``model``), the processes
it kills and times (``processes``) and what it shows (``report``)."""
