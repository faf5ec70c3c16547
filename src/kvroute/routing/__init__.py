"""Routing: balancing policies (shared by the simulator and the live router) and, later, the
router-side index of which worker holds which block."""
