"""Relax IR as the stages hand it on: module files, the tuning tasks of a module, reading its
dataflow, and pictures of it. May import core, deploy and frontend."""
