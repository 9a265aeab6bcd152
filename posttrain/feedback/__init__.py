"""posttrain.feedback: people in the loop. ``sample`` draws the candidates people judge, the labelling app
(``posttrain label``) shows them and an append-only store keeps every judgement, and the statistics say how
far the labellers agree. A verb family beside eval and report, built on rollout/ and data/; no trainer
imports it, and its modules are imported where they are used (nothing here imports them eagerly)."""
