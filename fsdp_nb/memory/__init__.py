"""Memory: planned before anything is allocated, live per rank, and explained when a rank runs out."""
