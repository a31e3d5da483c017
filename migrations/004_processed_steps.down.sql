DROP TABLE IF EXISTS processed_steps;
