"""Steps: where each rank's step time goes (the live view), a deep look (the profile), logged scalars."""
