"""The front ends a user meets: the Accelerate plugin and the Trainer integration."""
