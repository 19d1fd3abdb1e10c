"""The doors: the Lightning callback, the 🤗 Trainer callback and ``attach()`` for a plain loop, over one options
object (``options``), one assembly (``assemble``) and one end (``door``, ``lifecycle``); each door only reports
its framework's events to the boundaries."""
