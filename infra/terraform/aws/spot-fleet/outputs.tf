output "asg_name" {
  description = "Auto scaling group name: fleet.yaml aws.asg_name."
  value       = aws_autoscaling_group.this.name
}

output "queue_url" {
  description = "SQS queue of interruption warnings and rebalance recommendations: fleet.yaml aws.queue_url."
  value       = aws_sqs_queue.interruptions.id
}

output "queue_arn" {
  description = "ARN of the interruption queue."
  value       = aws_sqs_queue.interruptions.arn
}

output "controller_policy_arn" {
  description = "IAM policy to attach to the fleet controller's role or user."
  value       = aws_iam_policy.controller.arn
}

output "host_role_arn" {
  description = "IAM role of the hosts (reads the weak-key secret only)."
  value       = aws_iam_role.host.arn
}

output "launch_template_id" {
  description = "Launch template of the hosts."
  value       = aws_launch_template.this.id
}
