output "project_url" {
  description = "Master URL of the BOINC project."
  value       = module.server.project_url
}

output "server_instance_id" {
  description = "Server VM (aws ssm start-session --target ...)."
  value       = module.server.instance_id
}

output "weak_key_secret_arn" {
  description = "Store the weak account key here (aws secretsmanager put-secret-value)."
  value       = module.server.weak_key_secret_arn
}

output "gpu_asg_name" {
  description = "fleet.yaml aws.asg_name of the GPU fleet."
  value       = module.gpu_fleet.asg_name
}

output "gpu_queue_url" {
  description = "fleet.yaml aws.queue_url of the GPU fleet."
  value       = module.gpu_fleet.queue_url
}

output "cpu_asg_name" {
  description = "fleet.yaml aws.asg_name of the CPU fleet."
  value       = module.cpu_fleet.asg_name
}

output "cpu_queue_url" {
  description = "fleet.yaml aws.queue_url of the CPU fleet."
  value       = module.cpu_fleet.queue_url
}

output "controller_policy_arns" {
  description = "Policies to attach to the role the fleet controller runs as."
  value       = [module.gpu_fleet.controller_policy_arn, module.cpu_fleet.controller_policy_arn]
}
