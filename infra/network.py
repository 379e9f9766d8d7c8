"""Network stack: VPC, S3 gateway endpoint, interface endpoints, load-balancer subnet tags, EFA
security group.

The control plane needs subnets in two or more AZs (an EKS requirement); every node group uses
the private subnet of one AZ (`cfg.az`), so EFA/NCCL traffic never crosses an AZ boundary.
Nodes reach Pod Identity (eks-auth), STS, ECR (api, dkr; layers come from S3), CloudWatch Logs,
EC2 (the VPC CNI's ipamd attaches interfaces and assigns addresses through the EC2 API) and SSM
(Session Manager: ssm, ssmmessages, ec2messages) through interface endpoints, so the one NAT
gateway is on no path that node start-up, pod networking or S3 credentials depend on (EKS user
guide, "Deploy private clusters with limited internet access": ec2 for the VPC CNI; Systems
Manager user guide, "Use VPC endpoints": ssm, ssmmessages, ec2messages).

The S3 gateway endpoint's policy admits only buckets of this account and, for reading, the two
buckets of other accounts that a deploy pulls from through it: the ECR layer bucket of the region
(ECR user guide, "Amazon ECR interface VPC endpoints": image layers come from
prod-<region>-starport-layer-bucket) and registry.k8s.io's blob bucket of the region, from which
the kubectl handler's `helm pull` of the LWS chart (oci://registry.k8s.io) fetches the chart
(REGISTRY_K8S_IO_BUCKETS). Everything else a first deploy fetches from the private subnets leaves
through the NAT, not S3: the other charts (GitHub Pages and GitHub releases), the EKS API of
`aws eks update-kubeconfig`; nodeadm and the add-ons pull images from ECR only. Credentials taken
from a pod cannot copy data out to a bucket of another account through the endpoint; the
checkpoint and artifacts buckets in turn refuse the Pod Identity roles outside this endpoint
(infra/storage.py, aws:SourceVpce). tests/test_infra_stacks.py evaluates these requests against
the synthesized policies.
"""

from __future__ import annotations

from aws_cdk import Aws, Stack, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra.config import PRIVATE_SUBNET_MASK, PUBLIC_SUBNET_MASK, DeploymentConfig

# The rule aws-cdk-lib itself renders for "no outbound traffic" (ICMP type 252, code 86, to the
# broadcast address): it matches no packet.
NO_TRAFFIC_EGRESS = {"CidrIp": "255.255.255.255/32", "Description": "Disallow all traffic",
                     "IpProtocol": "icmp", "FromPort": 252, "ToPort": 86}

INTERFACE_ENDPOINTS = {
    "EksAuth": ec2.InterfaceVpcEndpointAwsService.EKS_AUTH,      # Pod Identity credentials
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDkr": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Ec2": ec2.InterfaceVpcEndpointAwsService.EC2,               # VPC CNI (ipamd)
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,               # Session Manager on the nodes
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    "Ec2Messages": ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES,
}


# registry.k8s.io answers a blob GET from an AWS address of region R with a redirect to an S3 bucket
# of the Kubernetes project (archeio, kubernetes/registry.k8s.io cmd/archeio/internal/app/buckets.go
# awsRegionToHostURL, read at 093d55a): the regions below have that bucket in R itself, so the
# unsigned GET takes the gateway endpoint. Other regions are sent to another region's bucket,
# which the NAT reaches (a gateway endpoint serves its own region only).
REGISTRY_K8S_IO_BUCKETS = {
    **{r: f"prod-registry-k8s-io-{r}" for r in (
        "af-south-1", "ap-east-1", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3", "ap-south-1", "ap-south-2",
        "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4", "ap-southeast-5", "ap-southeast-6",
        "ap-southeast-7", "ca-central-1", "ca-west-1", "eu-central-1", "eu-central-2", "eu-north-1", "eu-south-1",
        "eu-south-2", "eu-west-1", "eu-west-3", "il-central-1", "me-central-1", "mx-central-1", "sa-east-1",
        "us-east-1", "us-east-2", "us-west-1", "us-west-2")},
    "eu-west-2": "767373bbdcb8270361b96548387bf2a9ad0d48758c35-eu-west-2",
}


def s3_endpoint_statements(account: str, region: str) -> list[iam.PolicyStatement]:
    """Statements of the S3 gateway endpoint's policy: this account's buckets; reads of the ECR
    layer bucket and of registry.k8s.io's blob bucket of `region`."""
    statements = [
        iam.PolicyStatement(
            sid="ThisAccountsBuckets", principals=[iam.AnyPrincipal()], actions=["s3:*"], resources=["*"],
            conditions={"StringEquals": {"aws:ResourceAccount": account}}),
        iam.PolicyStatement(
            sid="EcrImageLayers", principals=[iam.AnyPrincipal()], actions=["s3:GetObject"],
            resources=[f"arn:{Aws.PARTITION}:s3:::prod-{region}-starport-layer-bucket/*"]),
    ]
    if region in REGISTRY_K8S_IO_BUCKETS:
        statements.append(iam.PolicyStatement(
            sid="KubernetesRegistryBlobs", principals=[iam.AnyPrincipal()], actions=["s3:GetObject"],
            resources=[f"arn:{Aws.PARTITION}:s3:::{REGISTRY_K8S_IO_BUCKETS[region]}/*"]))
    return statements


class NetworkStack(Stack):
    """VPC with public and private subnets in `cfg.control_plane_azs`, plus the EFA security group.

    Attributes other stacks use: vpc, node_subnets (the private subnet of `cfg.az`, a
    SubnetSelection), control_plane_subnets (private subnets of every AZ), efa_sg, s3_endpoint.
    """

    def __init__(self, scope: Construct, id: str, *, cfg: DeploymentConfig, **kw) -> None:
        self._azs = list(cfg.control_plane_azs)
        super().__init__(scope, id, **kw)
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(cfg.vpc_cidr),
            # Explicit AZs: no context lookup, so synth works offline.
            availability_zones=cfg.control_plane_azs,
            # One NAT gateway, in the node AZ: nodes are all there.
            nat_gateways=1,
            nat_gateway_subnets=ec2.SubnetSelection(
                subnet_type=ec2.SubnetType.PUBLIC, availability_zones=[cfg.az]
            ),
            subnet_configuration=[
                ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=PUBLIC_SUBNET_MASK),
                # Large private subnets: the VPC CNI gives every pod an address, and each EFA
                # interface of a p5 node takes one.
                ec2.SubnetConfiguration(
                    name="private", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=PRIVATE_SUBNET_MASK
                ),
            ],
            restrict_default_security_group=True,
        )
        flow_log_group = logs.LogGroup(self, "FlowLogs", retention=logs.RetentionDays.ONE_MONTH)
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.REJECT,
        )
        # Checkpoint traffic to S3 stays on the AWS network and skips the NAT gateway.
        self.s3_endpoint = self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        for statement in s3_endpoint_statements(cfg.account, cfg.region):
            self.s3_endpoint.add_to_policy(statement)
        # Private DNS on: the SDKs and the kubelet's credential provider resolve the usual names.
        # Each endpoint's security group admits 443 from the VPC CIDR (the construct's default).
        self.interface_endpoints = {
            name: self.vpc.add_interface_endpoint(
                name, service=service, private_dns_enabled=True,
                subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS),
            )
            for name, service in INTERFACE_ENDPOINTS.items()
        }

        # Subnet tags the AWS Load Balancer Controller uses to place load balancers.
        for subnet in self.vpc.public_subnets:
            Tags.of(subnet).add("kubernetes.io/role/elb", "1")
        for subnet in self.vpc.private_subnets:
            Tags.of(subnet).add("kubernetes.io/role/internal-elb", "1")

        self.control_plane_subnets = ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS)
        self.node_subnets = ec2.SubnetSelection(
            subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, availability_zones=[cfg.az]
        )

        # EFA needs all traffic allowed to and from the same security group. Egress rules are
        # only rendered when allow_all_outbound is off, so turn it off and add the rules.
        self.efa_sg = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=self.vpc,
            description="EFA: all traffic between members of this group",
            allow_all_outbound=False,
        )
        self.efa_sg.add_ingress_rule(self.efa_sg, ec2.Port.all_traffic(), "EFA from members")
        self.efa_sg.add_egress_rule(self.efa_sg, ec2.Port.all_traffic(), "EFA to members")
        # A rule that refers to its own group is a separate AWS::EC2::SecurityGroupEgress resource,
        # and the construct then renders no inline egress at all; a security group created without
        # inline egress keeps EC2's default allow-all egress rule (CloudFormation,
        # AWS::EC2::SecurityGroup SecurityGroupEgress). An inline rule that matches nothing makes
        # CloudFormation remove that default, so only the self rule above remains.
        cfn_sg: ec2.CfnSecurityGroup = self.efa_sg.node.default_child  # type: ignore[assignment]
        cfn_sg.add_property_override("SecurityGroupEgress", [NO_TRAFFIC_EGRESS])
        # Nodes also need to reach the cluster, ECR, S3 and the internet: the cluster security
        # group (attached next to this one on every interface) allows that outbound traffic.

    @property
    def availability_zones(self) -> list[str]:
        """The configured AZs; overriding this keeps synth free of an AZ context lookup."""
        return self._azs
