output "project_url" {
  description = "Master URL of the BOINC project."
  value       = module.server.project_url
}

output "weak_key_secret" {
  description = "Add the weak account key here (gcloud secrets versions add)."
  value       = module.server.weak_key_secret_name
}

output "zone" {
  description = "fleet.yaml gcp.zone."
  value       = module.gpu_fleet.zone
}

output "gpu_mig" {
  description = "fleet.yaml gcp.mig of the GPU fleet."
  value       = module.gpu_fleet.mig_name
}

output "gpu_on_demand_mig" {
  description = "fleet.yaml gcp.on_demand_mig of the GPU fleet."
  value       = module.gpu_fleet.on_demand_mig_name
}

output "cpu_mig" {
  description = "fleet.yaml gcp.mig of the CPU fleet."
  value       = module.cpu_fleet.mig_name
}

output "cpu_on_demand_mig" {
  description = "fleet.yaml gcp.on_demand_mig of the CPU fleet."
  value       = module.cpu_fleet.on_demand_mig_name
}

output "controller_service_accounts" {
  description = "Service accounts holding the controller's roles on the groups."
  value       = [module.gpu_fleet.controller_service_account, module.cpu_fleet.controller_service_account]
}
