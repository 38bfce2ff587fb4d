"""What is asked of files and the file system they lie on: a report or record written safely
(``records``), which mount holds a path (``mounts``), whether a path may hold code this process
loads (``trust``). Standard library only."""
