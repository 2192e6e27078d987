"""What the supervisor and the worker share: message types and their wire codec. Imports neither side."""
